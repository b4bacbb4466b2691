import sys, functools
sys.path.insert(0, 'benchmarks'); sys.path.insert(0, '.')
import kernel_registers as kr
import depthrewrite.kernels.route_many_triton as rm
ptxas = sys.argv[1]
for queries, caps in ((4, (168, 128)), (8, (None, 168, 128)), (1, (None, 128))):
    for cap in caps:
        entry = rm._entry_by_queries(rm.PER_TOKEN_LAUNCH, queries)
        rm.PER_TOKEN_LAUNCH = {**rm.PER_TOKEN_LAUNCH, queries: (entry[0], cap)}
        for g_raw, qw in ((False, False), (True, False), (False, True), (True, True)):
            ptx, warps = kr.compile_many_per_token_backward(1024, 1, False, queries=queries, g_raw=g_raw, qw_reload=qw)
            print(f"S={queries} cap={cap} g_raw={g_raw:d} qw_reload={qw:d} warps={warps}: " + kr.describe(ptx, ptxas, warps), flush=True)
