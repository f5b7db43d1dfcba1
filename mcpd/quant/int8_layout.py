"""The layout of the int8 form (int8.py) that code without torch sizes too (parameter_table.py):
how many scales a matrix has, and their parameters' names."""

GROUP = 64                # input columns per scale; kernels.c is compiled with it (native.py)
SCALE_SUFFIX = "_scale"   # the scale of parameter "x.weight" is "x.weight_scale"


def groups(columns: int) -> int:
    """Scales per row of a matrix with this many columns (the last group may be short)."""
    return -(-columns // GROUP)
