"""The layout of the 4-bit form (int4.py) that code without torch sizes too (parameter_table.py):
GGUF's Q4_0 and Q4_1 blocks, kept as the file holds them."""

BLOCK = 32                # columns per block: one float16 scale d and min m each
SCALES_SUFFIX = "_q4d"    # parameter "x.weight" (bytes, two weights each) has "x.weight_q4d" beside it
MINS_SUFFIX = "_q4m"      # and "x.weight_q4m": w = d * q + m, q the weight's 4 bits


def shapes(rows: int, columns: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(the weight bytes' shape, the scales' and the mins' shape) of a [rows, columns] matrix."""
    return (rows, columns // 2), (rows, columns // BLOCK)
