"""A generate request has one type from client to sampler: its sampling fields are declared once
(protocol/sampling.py), decoded once at the front-end, and read as they are by the scheduler and
the engine, so `max_tokens` passes through few files."""
import ast
import re
from pathlib import Path

import mcpd
from mcpd.protocol.sampling import SamplingParams

PACKAGE = Path(mcpd.__file__).parent
MOST_FILES_NAMING_MAX_TOKENS = 8


def sources() -> dict[str, str]:
    return {str(path.relative_to(PACKAGE)): path.read_text() for path in sorted(PACKAGE.rglob("*.py"))}


def carries_max_tokens(text: str) -> bool:
    """The code names the value (an attribute, a variable, a keyword, a map key, a message; a cap
    of it too: `max_tokens_cap`), not only a docstring or comment. `degrade_max_tokens` is the
    config's own key: a class's cap, not a request's."""
    tree = ast.parse(text)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)}
    for node in ast.walk(tree):
        named = (node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name)
                 else node.arg if isinstance(node, (ast.keyword, ast.arg)) else
                 node.name if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else "")
        if named != "degrade_max_tokens" and re.fullmatch(r"(\w+_)?max_tokens(_\w+)?", named or ""):
            return True
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings \
                and re.search(r"\bmax_tokens\b", node.value):
            return True
    return False


def test_max_tokens_travels_through_few_files():
    """sampling.py declares it, the HTTP listener and testing's load put a client's in the args,
    the scheduler prices and caps it (admission; the ladder's cap: degradation), the result says
    a cap (results.py), the engine stops at it."""
    naming = [name for name, text in sources().items() if carries_max_tokens(text)]
    assert len(naming) <= MOST_FILES_NAMING_MAX_TOKENS, naming


def test_the_sampling_fields_are_declared_with_their_defaults_in_one_place():
    """A class field of one of these names with a default (stop, seed, logprobs name other things too)."""
    fields = "|".join(set(SamplingParams.__struct_fields__) - {"stop", "seed", "logprobs"})
    declaring = [name for name, text in sources().items() if re.search(rf"^\s+({fields})\s*:[^=\n]+=", text, re.M)]
    assert declaring == ["protocol/sampling.py"]


def test_the_sampling_struct_is_decoded_in_one_place():
    decoding = [name for name, text in sources().items() if re.search(r"convert\([^)]*SamplingParams", text)]
    assert decoding == ["protocol/sampling.py"]
