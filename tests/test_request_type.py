"""A generate request has one type from client to sampler: its sampling fields are declared once
(protocol/sampling.py), decoded once at the front-end, and read as they are by the scheduler and
the engine, so `max_tokens` passes through few files."""
import re
from pathlib import Path

import mcpd
from mcpd.protocol.sampling import SamplingParams

PACKAGE = Path(mcpd.__file__).parent
MOST_FILES_NAMING_MAX_TOKENS = 8


def sources() -> dict[str, str]:
    return {str(path.relative_to(PACKAGE)): path.read_text() for path in sorted(PACKAGE.rglob("*.py"))}


def test_max_tokens_travels_through_few_files():
    """sampling.py declares it, the front-end's HTTP listener and testing's load map OpenAI's and a
    client's to it, the scheduler prices and caps it (admission, degradation and its config key),
    the result says a cap (results.py), the engine stops at it."""
    naming = [name for name, text in sources().items() if "max_tokens" in text]
    assert len(naming) <= MOST_FILES_NAMING_MAX_TOKENS, naming


def test_the_sampling_fields_are_declared_with_their_defaults_in_one_place():
    """A class field of one of these names with a default (stop, seed, logprobs name other things too)."""
    fields = "|".join(set(SamplingParams.__struct_fields__) - {"stop", "seed", "logprobs"})
    declaring = [name for name, text in sources().items() if re.search(rf"^\s+({fields})\s*:[^=\n]+=", text, re.M)]
    assert declaring == ["protocol/sampling.py"]


def test_the_sampling_struct_is_decoded_in_one_place():
    decoding = [name for name, text in sources().items() if re.search(r"convert\([^)]*SamplingParams", text)]
    assert decoding == ["protocol/sampling.py"]
