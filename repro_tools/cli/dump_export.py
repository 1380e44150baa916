"""``repro-tools dump export PATH --npy``: a dump's stored tensors as ptdbg-named ``.npy`` files.

For scripts and notebooks that inspect single tensors with numpy, as ptdbg's dump
directories allowed.  The export itself is :func:`determ_backend.dump.comparison.export.export_npy`.
Exit 0: written; 2: bad input (a statistics-only dump included).
"""

from __future__ import annotations

import argparse

from determ_backend.dump.comparison.export import export_npy

__all__ = ["register", "run_export"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dump", help="work with API dumps written by determ_backend.dump (export)",
                       description="Work with API dumps written by determ_backend.dump.")
    dsub = p.add_subparsers(dest="dump_command", metavar="SUBCOMMAND", required=True)
    e = dsub.add_parser("export", help="write every stored tensor as a .npy file named as ptdbg names it",
                        description="Write every tensor stored in the dump at PATH as "
                                    "OUT/<entry>_<tensor>.npy (e.g. Functional_conv2d_0_forward_input.0.npy); a "
                                    "directory of rank folders goes to OUT/rank<N>/.  bfloat16 (which numpy lacks) "
                                    "is written as float32.  A statistics-only dump has nothing to export (exit 2).")
    e.add_argument("path", metavar="PATH",
                   help="an index (*.pkl), the rank directory holding it, or a directory of rank<N> folders")
    e.add_argument("--npy", action="store_true", required=True, help="write .npy files (the one format for now)")
    e.add_argument("-o", "--output", default="./dump_npy", metavar="OUT", help="output directory (default ./dump_npy)")
    e.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    result = export_npy(args.path, args.output)
    print(f"wrote {len(result.files)} .npy files to {result.out}")
    return 0
