import sys
sys.path.insert(0, 'benchmarks'); sys.path.insert(0, '.')
import kernel_registers as kr
import depthrewrite.kernels.route_triton as rt
ptxas = sys.argv[1]
for stages in (0, 3):
    for cap in (None, 128, 96):
        for block_t, warps in ((2, 4), (1, 4), (1, 2)):
            c = dict(HAS_KEYS=False, HAS_BIAS=False, HAS_SCALE=False, ONE_SOURCE=False, BLOCK_T=block_t, BLOCK_H=16,
                     BLOCK_C=64, ALIGNED=True, PREFETCH=True, HAS_NORM=False, HAS_ACC=True, STAGES=stages,
                     FUSED_SUMS=True)
            ptx = kr._compile(rt._route_bwd_kernel, kr.ARG_TYPES, c, warps, cap)
            print(f"bwd 16h sums stages={stages} cap={cap} block_t={block_t} warps={warps}: " + kr.describe(ptx, ptxas, warps, memory=False), flush=True)
for stages in (0, 3):
    for block_t, warps in ((2, 4), (1, 2), (2, 2)):
        c = dict(HAS_KEYS=False, HAS_BIAS=False, HAS_SCALE=False, ONE_SOURCE=False, BLOCK_T=block_t, BLOCK_H=16,
                 BLOCK_C=64, PREFETCH=True, ALIGNED=True, HAS_NORM=False, PAIR_REDUCE=False, STAGES=stages, LAZY=True)
        ptx = kr._compile(rt._route_fwd_kernel, kr.ARG_TYPES, c, warps, None)
        print(f"fwd 16h stages={stages} block_t={block_t} warps={warps}: " + kr.describe(ptx, ptxas, warps, memory=False), flush=True)
