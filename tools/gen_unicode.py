#!/usr/bin/env python3
"""gen_unicode.py - writes engine/unicode_tables.c, the Unicode tables of the tokenizer.

    python3 tools/gen_unicode.py [--module unicodedata|unicodedata2] [--out engine/unicode_tables.c]

Emits one sorted table that partitions U+0000..U+10FFFF into runs of equal
General Category (every code point is covered; unassigned runs are Cn), and the
White_Space list (PropList.txt; unicodedata does not expose that property, so it
is written out below and checked against the general categories).

Which Unicode version: the tokenizer must agree with the regex engine of the
reference implementation (Hugging Face `tokenizers`, whose wheels bundle
Oniguruma; the 0.2x wheels use Unicode 16.0).  The standard library module of an
older Python carries an older version, so the module is chosen on the command
line and its version is written into the output.  The committed table was made
with `.venv/bin/python tools/gen_unicode.py --module unicodedata2` (PyPI
unicodedata2==16.0.0, pinned in tests/requirements.txt; the same API as
unicodedata); tests/integration/test_tokenizer.py regenerates it and compares.  Output depends only on the module's data: running it twice gives
the same bytes.
"""
import argparse
import importlib
import pathlib
import sys

# Order and spelling match enum uni_gc in engine/unicode.h (entries are emitted
# by name, so a mismatch fails to compile instead of mislabelling).
CATEGORIES = ["Cn", "Lu", "Ll", "Lt", "Lm", "Lo", "Mn", "Mc", "Me", "Nd", "Nl", "No",
              "Pc", "Pd", "Ps", "Pe", "Pi", "Pf", "Po", "Sm", "Sc", "Sk", "So",
              "Zs", "Zl", "Zp", "Cc", "Cf", "Cs", "Co"]

# PropList.txt White_Space (unchanged since Unicode 6.3, when U+180E left it).
WHITE_SPACE = [(0x0009, 0x000D), (0x0020, 0x0020), (0x0085, 0x0085), (0x00A0, 0x00A0),
               (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029), (0x202F, 0x202F),
               (0x205F, 0x205F), (0x3000, 0x3000)]

MAX_CP = 0x10FFFF


def runs(ud):
    out = []
    prev = None
    for cp in range(MAX_CP + 1):
        gc = ud.category(chr(cp))
        if gc not in CATEGORIES:
            sys.exit(f"U+{cp:04X}: unknown general category {gc}")
        if gc != prev:
            out.append((cp, gc))
            prev = gc
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--module", default="unicodedata", choices=["unicodedata", "unicodedata2"])
    ap.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parents[1]
                                         / "engine" / "unicode_tables.c"))
    args = ap.parse_args()
    ud = importlib.import_module(args.module)
    version = ud.unidata_version

    for lo, hi in WHITE_SPACE:  # sanity: White_Space is Zs/Zl/Zp or a control
        for cp in range(lo, hi + 1):
            if ud.category(chr(cp)) not in ("Zs", "Zl", "Zp", "Cc"):
                sys.exit(f"White_Space U+{cp:04X} has category {ud.category(chr(cp))}")
    zs = [cp for cp in range(MAX_CP + 1) if ud.category(chr(cp)) == "Zs"]
    ws_set = {cp for lo, hi in WHITE_SPACE for cp in range(lo, hi + 1)}
    if any(cp not in ws_set for cp in zs):
        sys.exit("a Zs code point is missing from WHITE_SPACE: update the list from PropList.txt")

    table = runs(ud)
    lines = []
    lines.append("/*")
    lines.append(" * unicode_tables.c - General Category and White_Space tables (generated).")
    lines.append(" *")
    lines.append(f" * Unicode version {version}, written by tools/gen_unicode.py --module {args.module};")
    lines.append(" * do not edit: change the generator and run it again.  Read only by unicode.c")
    lines.append(" * (const data, safe from any thread).  Invariant: uni_gc_runs is sorted by")
    lines.append(" * start code point, begins at U+0000 and each entry holds until the next one.")
    lines.append(" */")
    lines.append('#include "engine/unicode_impl.h"')
    lines.append("")
    lines.append(f'const char uni_tables_version[] = "{version}";')
    lines.append("")
    lines.append("#define R(start, gc) (((uint32_t)(start) << UNI_RUN_SHIFT) | UNI_GC_##gc)")
    lines.append("")
    lines.append("const uint32_t uni_gc_runs[] = {")
    row = []
    for cp, gc in table:
        row.append(f"R(0x{cp:06X}, {gc.upper()})")
        if len(row) == 4:
            lines.append("\t" + ", ".join(row) + ",")
            row = []
    if row:
        lines.append("\t" + ", ".join(row) + ",")
    lines.append("};")
    lines.append("const size_t uni_gc_nruns = sizeof uni_gc_runs / sizeof uni_gc_runs[0];")
    lines.append("")
    lines.append("/* White_Space (PropList.txt): inclusive ranges. */")
    lines.append("const uint32_t uni_ws_ranges[][2] = {")
    for lo, hi in WHITE_SPACE:
        lines.append(f"\t{{0x{lo:04X}, 0x{hi:04X}}},")
    lines.append("};")
    lines.append("const size_t uni_ws_nranges = sizeof uni_ws_ranges / sizeof uni_ws_ranges[0];")
    lines.append("")
    pathlib.Path(args.out).write_text("\n".join(lines))
    print(f"gen_unicode: Unicode {version}: {len(table)} runs -> {args.out}")


if __name__ == "__main__":
    main()
