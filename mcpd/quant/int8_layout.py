"""The layout of the int8 form (int8.py) that code without torch sizes too (parameter_table.py):
how many scales a matrix has, and their parameters' names."""

GROUP = 64                # input columns per scale as mcpd quantizes (int8.quantize)
GGUF_GROUP = 32           # a GGUF Q8_0 block's: such weights keep their file's own scales
GROUPS = (GROUP, GGUF_GROUP)
SCALE_SUFFIX = "_scale"   # the scale of parameter "x.weight" is "x.weight_scale"


def groups(columns: int, group: int = GROUP) -> int:
    """Scales per row of a matrix with this many columns (the last group may be short)."""
    return -(-columns // group)


def group_of(columns: int, scales: int) -> int:
    """The group size of a matrix of `columns` columns with `scales` scales a row: the one of
    GROUPS that gives that count (where two do, each group spans the whole row: either is right)."""
    return next((g for g in GROUPS if groups(columns, g) == scales), GROUP)
