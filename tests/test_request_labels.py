"""The labels a request's figures get, in-process: configured models and classes only, and a
reload's classes and defaults taken as the scheduler takes them."""
from mcpd.config import from_dict
from mcpd.daemon.frontend.request_labels import NO_MODEL, UNKNOWN, RequestLabels
from mcpd.protocol.args import ContextOpenArgs, GenerateArgs, InferArgs, PingArgs

MODELS = {"chat": {"versions": {"v1": {}}}, "risk": {"versions": {"v1": {}}}}


def config(default_model: str = "chat", classes: dict | None = None, default_class: str = "normal"):
    scheduler = {"default_class": default_class, **({"classes": classes} if classes else {})}
    return from_dict({"models": MODELS, "routing": {"default_model": default_model}, "scheduler": scheduler})


def test_models_named_by_config_label_requests_and_any_other_name_shares_one_label():
    labels = RequestLabels(config())
    assert labels.model_of(GenerateArgs(prompt="x")) == "chat"   # names none: the default model
    assert labels.model_of(InferArgs(inputs=(), model="risk")) == "risk"
    assert {labels.model_of(GenerateArgs(prompt="x", model=f"made-up-{i}")) for i in range(100)} == {UNKNOWN}
    assert labels.model_of(PingArgs()) == labels.model_of(ContextOpenArgs(id="c")) == NO_MODEL


def test_classes_named_by_config_label_requests_and_any_other_name_shares_one_label():
    labels = RequestLabels(config())
    assert (labels.class_of(None), labels.class_of("high")) == ("normal", "high")
    assert {labels.class_of(f"made-up-{i}") for i in range(100)} == {UNKNOWN}


def test_a_reload_brings_its_classes_and_a_default_model_the_daemon_serves():
    labels = RequestLabels(config())
    labels.reconfigure(config("risk", classes={"gold": {"rank": 1}, "bulk": {"rank": 0}}, default_class="bulk"))
    assert (labels.model_of(GenerateArgs(prompt="x")), labels.class_of(None)) == ("risk", "bulk")
    assert (labels.class_of("gold"), labels.class_of("high")) == ("gold", UNKNOWN)
    grown = from_dict({"models": {**MODELS, "new": {"versions": {"v1": {}}}}, "routing": {"default_model": "new"}})
    labels.reconfigure(grown)   # a model added by a reload is served only after a restart: not a label yet
    assert labels.model_of(GenerateArgs(prompt="x")) == "risk"
    assert labels.model_of(GenerateArgs(prompt="x", model="new")) == UNKNOWN
