"""A config names a handler class; a wrong name says what is wrong."""
import pytest

from mcpd.handlers.handler import Handler, load_handler


@pytest.mark.parametrize("reference, says", [
    ("no_colon", "package.module:Class"), ("mcpd_no_such_module:X", "cannot import"),
    ("os:path", "no Handler subclass"), ("mcpd.handlers.handler:load_handler", "no Handler subclass"),
])
def test_bad_references_are_refused_with_the_reason(reference, says):
    with pytest.raises(ValueError, match=says):
        load_handler(reference)


def test_a_good_reference_gives_an_instance():
    assert type(load_handler("mcpd.handlers.handler:Handler")) is Handler
