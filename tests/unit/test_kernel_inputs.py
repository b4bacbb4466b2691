"""benchmarks/kernel_inputs.py: the join of a kernel profile with Inductor's logged code
that docs/benchmarks.md's bandwidth figures for Inductor's kernels come from."""

import pytest

from tests.benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def kernel_inputs():
    return load_benchmark("kernel_inputs")


def _kernel(name: str, args: str, gb: float, nodes: str) -> str:
    # the shape of TORCH_LOGS=output_code's module: the nodes comment, then the kernel's source
    return (f"# Topologically Sorted Source Nodes: [{nodes}]\n"
            f"{name} = async_compile.triton('{name}', '''\n"
            f"@triton.jit\ndef {name}({args}):\n"
            f"    pass\n# inductor_meta={{'kernel_num_gb': {gb}}}\n''', device_str='cuda')\n")


CODE = (_kernel("triton_poi_fused_add_0", "in_ptr0, in_ptr1, out_ptr0, xnumel, XBLOCK : tl.constexpr", 0.5, "a, b, add")
        + _kernel("triton_per_fused_norm_sum_long_name_1", "in_out_ptr0, in_ptr0, out_ptr0, xnumel", 0.2, "x, y")
        + _kernel("triton_per_fused_norm_sum_long_name_2", "in_ptr0, in_ptr1, in_ptr2, out_ptr0, xnumel", 0.4, "z"))


def test_a_whole_name_gets_its_kernel_and_bandwidth(kernel_inputs):
    kernels = kernel_inputs.inductor_kernels(CODE)
    row = kernel_inputs.table(kernels, [(0.25, 2, "triton_poi_fused_add_0")])[2]
    # 2 inputs, 1 output, none in place; 0.5 GB a call, 2 calls in 0.25 ms = 4 TB/s
    assert row == "| 0.25 | 2 | 2 | 1 | 0 | 0.500 | 4.00 | triton_poi_fused_add_0 | a, b, add |"


def test_a_cut_name_shared_by_several_kernels_gives_ranges(kernel_inputs):
    kernels = kernel_inputs.inductor_kernels(CODE)
    row = kernel_inputs.table(kernels, [(0.1, 1, "triton_per_fused_norm_sum_long")])[2]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2:7] == ["1-3", "1", "0-1", "0.200-0.400", "2.00-4.00"]
    assert "one of 2 kernels" in cells[7]


def test_a_kernel_not_in_the_code_keeps_its_time_alone(kernel_inputs):
    kernels = kernel_inputs.inductor_kernels(CODE)
    row = kernel_inputs.table(kernels, [(3.5, 24, "nvjet_sm90_gemm")])[2]
    assert row == "| 3.50 | 24 | | | | | | nvjet_sm90_gemm | |"
