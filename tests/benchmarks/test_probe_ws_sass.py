"""benchmarks/probes/ws_sass.py's SASS loop reader (the compile itself needs the device's Triton, 3.6)."""

from __future__ import annotations

from benchmarks.probes.ws_sass import sass_loops

# nvdisasm -c's shape: a prologue, an outer loop with an inner tile loop (wgmma, a spill, a
# shared load, a barrier), a loop without wgmma, and a forward branch that is not a loop
LISTING = """\
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   IADD3 R2, R2, 0x1, RZ ;
.L_x_1:
        /*0020*/                   LDL R3, [R1+0x4] ;
        /*0030*/                   QGMMA.64x64x32.F32.E4M3.E4M3 R56, gdesc[UR8], RZ, !UPT ;
        /*0040*/                   QGMMA.64x64x32.F32.E4M3.E4M3 R56, gdesc[UR12], R56, gsb0 ;
        /*0050*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0060*/                   LDSM.16.M88.4 R4, [R5] ;
        /*0070*/                   BAR.SYNC.DEFER_BLOCKING 0x1, 0x80 ;
        /*0080*/              @!P0 BRA `(.L_x_1) ;
        /*0090*/              @!P1 BRA `(.L_x_0) ;
.L_x_2:
        /*00a0*/                   IADD3 R6, R6, 0x1, RZ ;
        /*00b0*/              @!P2 BRA `(.L_x_2) ;
        /*00c0*/              @P3 BRA `(.L_x_3) ;
        /*00d0*/                   STL [R1], R0 ;
.L_x_3:
        /*00e0*/                   EXIT ;
"""


def test_sass_loops_finds_the_innermost_wgmma_loop_and_counts_its_instructions() -> None:
    loops = sass_loops(LISTING)
    assert len(loops) == 1  # the outer loop holds the inner one; .L_x_2 has no wgmma
    (tile,) = loops
    assert (tile.start, tile.end) == (3, 10)
    assert tile.instructions == 7
    assert tile.qgmma == 2
    assert tile.local_memory == 1  # the LDL; the STL after the loop is not counted
    assert tile.shared_loads == 1
    assert tile.barriers == 1  # BAR.SYNC, not WARPGROUP.DEPBAR


def test_sass_loops_counts_nothing_outside_loops() -> None:
    assert (
        sass_loops("        /*0000*/                   QGMMA.64x64x32 R0, gdesc[UR4], RZ ;\n") == []
    )
