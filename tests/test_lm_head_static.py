"""The SASS path counts behind bench/bench_lm_head_static.py, on small hand-written listings.

What: the epilogue starts after the HGMMA main loop and ends at the last EXIT; the other tiles'
count is the shortest path, the draft tiles' the shortest path with more global stores; a loop
in the epilogue counts `trips` times, and the guard that jumps over it is no path.
"""

from __future__ import annotations

import pytest
from _bench import load_bench

static = load_bench("bench_lm_head_static")


def _listing(body: list[str]) -> str:
    """cuobjdump-style lines, 16 bytes apart, from "OPCODE operands" strings; a branch target
    written as @N is the address of instruction N."""
    lines = []
    for i, text in enumerate(body):
        if "@" in text.split()[-1]:
            op, target = text.rsplit("@", 1)
            text = f"{op}0x{16 * int(target):x}"
        lines.append(f"        /*{16 * i:04x}*/                   {text} ;   /* 0x0 */")
    return "\n".join(lines)


def _kernel(epilogue: list[str]) -> list[str]:
    # prologue, a main loop around an HGMMA, then the epilogue, EXIT and the trailing self-branch
    head = ["MOV R1, c[0x0][0x28]", "HGMMA.64x256x16.F32.BF16 R24, gdesc[UR8], R24", "@!P1 BRA @1"]
    n = len(head) + len(epilogue)
    return [*head, *epilogue, "EXIT", f"BRA @{n + 1}"]


def _paths(epilogue, trips=8):
    return static.epilogue_paths(static.parse_sass(_listing(_kernel(epilogue))), trips)


def test_a_draft_branch_splits_the_paths():
    # 3 = first epilogue instruction; the draft section (a store, two adds) is skipped by @P0
    epilogue = ["FMUL R0, R1, R2", "@P0 BRA @8", "STG.E [R2], R0", "FADD R0, R0, R1",
                "FADD R0, R0, R1", "STG.E [R4], R0"]  # fmt: skip
    # instruction indices: 3 FMUL, 4 BRA -> 8 (the common store), 5-7 draft, 8 store, 9 EXIT
    r = _paths(epilogue)
    assert r["epilogue_start"] == "0x30"
    assert r["path_min"] == 4  # FMUL, BRA, STG, EXIT
    assert r["path_min_more_stores"] == 7 == r["path_max"]


@pytest.mark.parametrize("trips", [1, 8])
def test_an_epilogue_loop_counts_per_trip_and_its_guard_is_no_path(trips):
    filler = ["FADD R0, R0, R1"] * 70  # a draft section longer than a loop guard's reach
    # 3 FMUL, 4 draft skip -> after the loop; 5.. filler; then the guard, the loop, the rest
    g = 5 + len(filler)  # the guard: jumps over the loop that starts right after it
    epilogue = ["FMUL R0, R1, R2", f"@P0 BRA @{g + 5}", *filler,
                f"@!P2 BRA @{g + 4}", "FMNMX R0, R0, R1, !PT", "STG.E [R6], R0", f"@P3 BRA @{g + 1}",
                "STG.E [R8], R0", "STG.E [R4], R0"]  # fmt: skip
    r = _paths(epilogue, trips)
    assert r["epilogue_loops"] == 1
    assert r["path_min"] == 4  # FMUL, the draft skip, the last store, EXIT
    # the draft path: FMUL, BRA, filler, guard, loop (3 x trips), 2 stores, EXIT
    assert r["path_min_more_stores"] == 2 + 70 + 1 + 3 * trips + 2 + 1
