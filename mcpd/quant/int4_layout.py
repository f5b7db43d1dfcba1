"""The layout of the 4-bit form (int4.py) that code without torch sizes too (parameter_table.py):
GGUF's Q4_0 and Q4_1 blocks, kept as the file holds them, Q4_K's super-blocks as Q4_1-ordered
bytes with their 6-bit scales and mins widened to a byte each, and Q6_K's as Q4_1-ordered low
nibbles beside their top two bits (the file's 210 bytes a super-block, rearranged)."""

BLOCK = 32                # columns per block: one scale d and min m each
SUPER_BLOCK = 256         # Q4_K: columns per super-block, one float16 d and dmin each
SCALES_SUFFIX = "_q4d"    # parameter "x.weight" (bytes, two weights each) has "x.weight_q4d" beside it
MINS_SUFFIX = "_q4m"      # and "x.weight_q4m": w = d * q + m, q the weight's 4 bits
SUPERS_SUFFIX = "_q4s"    # Q4_K: "x.weight_q4s", each super-block's d and dmin (Q6_K: its d)
HIGHS_SUFFIX = "_q6h"     # Q6_K: "x.weight_q6h", each weight's top two bits, four a byte
SUFFIXES = (SCALES_SUFFIX, MINS_SUFFIX, SUPERS_SUFFIX, HIGHS_SUFFIX)   # every tensor beside the bytes
Q6_GROUP = 16             # Q6_K: columns per int8 scale
FORMS = ("q4_0", "q4_1", "q4_k", "q6_k")


def shapes(rows: int, columns: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(the weight bytes' shape, the scales' and the mins' shape) of a [rows, columns] matrix."""
    return (rows, columns // 2), (rows, columns // BLOCK)


def supers_shape(rows: int, columns: int, form: str) -> tuple[int, int, int]:
    """Q4_K's float16 (d, dmin) pairs, Q6_K's d, of a [rows, columns] matrix."""
    return rows, columns // SUPER_BLOCK, 2 if form == "q4_k" else 1


def pieces(form: str, rows: int, columns: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """Suffix ("" for the weight itself) -> (shape, dtype name) of each tensor a form holds."""
    values, blocks = shapes(rows, columns)
    if form == "q4_k":
        return {"": (values, "uint8"), SCALES_SUFFIX: (blocks, "uint8"), MINS_SUFFIX: (blocks, "uint8"),
                SUPERS_SUFFIX: (supers_shape(rows, columns, form), "float16")}
    if form == "q6_k":
        return {"": (values, "uint8"), SCALES_SUFFIX: ((rows, columns // Q6_GROUP), "int8"),
                HIGHS_SUFFIX: ((rows, columns // 4), "uint8"), SUPERS_SUFFIX: (supers_shape(rows, columns, form), "float16")}
    listed = {"": (values, "uint8"), SCALES_SUFFIX: (blocks, "float16")}
    if form == "q4_1":
        listed[MINS_SUFFIX] = blocks, "float16"
    return listed
