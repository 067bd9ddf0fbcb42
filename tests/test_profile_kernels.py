"""The GPU-timeline analysis the benchmarks' published idle times come from
(benchmarks/profile/kernels.py), on made-up timelines."""

from benchmarks.profile.kernels import (
    describe_top_kernels, gaps, hlo_instructions, op_names,
)

# (name, start_us, dur_us, stream, op): a kernel, a device-to-host copy, 2 ms
# idle, a kernel; then a 30 us launch gap and a last kernel
KERNELS = [
    ("fusion_1", 0.0, 100.0, "Stream #1", "fusion.1"),
    ("MemcpyD2H", 100.0, 10.0, "Stream #2", "while/LogicalAnd/_6:_HostRecv"),
    ("fusion_2", 2110.0, 100.0, "Stream #1", "fusion.2"),
    ("fusion_3", 2240.0, 60.0, "Stream #1", "fusion.3"),
]


def test_gaps_name_copies_by_op_and_sort_gaps_into_bands():
    found = gaps(KERNELS, steps=1)
    assert found["gaps_per_step"] == {"under_50us": 1, "50us_to_1ms": 0, "1ms_or_more": 1}
    assert found["idle_ms_per_step"]["1ms_or_more"] == 2.0
    assert found["largest"][0] == {"ms": 2.0, "after": "MemcpyD2H [while/LogicalAnd/_6:_HostRecv]",
                                   "before": "fusion_2"}


def test_torch_children_start_without_folders_that_hold_a_cudnn(tmp_path):
    from benchmarks.common import torch_environment

    staged, plain = tmp_path / "staged", tmp_path / "plain"
    staged.mkdir(), plain.mkdir()
    (staged / "libcudnn.so.9").write_bytes(b"")
    (plain / "libcudart.so.12").write_bytes(b"")
    environ = {"LD_LIBRARY_PATH": f"{staged}:{plain}::/nonexistent", "PATH": "/bin"}
    env = torch_environment(environ)
    assert env["LD_LIBRARY_PATH"] == f"{plain}:/nonexistent"
    assert env["PATH"] == "/bin" and environ["LD_LIBRARY_PATH"].startswith(str(staged))  # the given one unchanged


# Lines as XLA's dump writes them (`--xla_dump_hlo_as_text`), one instruction a line, shortened.
_HLO = """HloModule a_inference_step, entry_computation_layout={()->f32[]}

%fc.138 (param_0.1: f32[256,197,768]) -> f32[768] {
  ROOT %Sum.7 = f32[768]{0} reduce(%param_0.1, %c), dimensions={0,1}, to_apply=%add, metadata={op_name="g/b1/Sum"}
}

ENTRY %main {
  %input_reduce_fusion.138 = f32[768]{0} fusion(%p.1), kind=kInput, calls=%fc.138, metadata={op_name="g/b1/Sum"}
  %input_add_reduce_fusion.23 = (f32[8]{0}, f32[8]{0}) fusion(%p), kind=kInput, calls=%f, metadata={op_name="g/ln"}
  %copy.5 = f32[768]{0} copy(%p.4)
  ROOT %tuple.1 = (f32[768]{0}) tuple(%input_reduce_fusion.138)
}
"""


def test_hlo_instructions_say_what_each_fused_kernel_computes(tmp_path):
    (tmp_path / "module_0001.step.sm_9.0_gpu_after_optimizations.txt").write_text(_HLO)
    (tmp_path / "module_0000.small.sm_9.0_gpu_after_optimizations.txt").write_text("HloModule small\n")
    found = hlo_instructions(str(tmp_path))  # the largest module's
    assert found["input_reduce_fusion.138"] == ("f32[768]{0}", "fusion", "g/b1/Sum")
    assert found["input_add_reduce_fusion.23"] == ("(f32[8]{0}, f32[8]{0})", "fusion", "g/ln")
    assert found["Sum.7"][1] == "reduce" and "copy.5" not in found  # no op name, not listed
    assert op_names(found)["input_reduce_fusion.138"] == "g/b1/Sum"
    profile = {"top_kernels": [{"name": "input_reduce_fusion_138", "op": "input_reduce_fusion.138"},
                               {"name": "nvjet_sm90_tst", "op": ""}]}
    describe_top_kernels(profile, found)
    first, second = profile["top_kernels"]
    assert (first["hlo_shape"], first["hlo_opcode"], first["tf_op"]) == ("f32[768]{0}", "fusion", "g/b1/Sum")
    assert "tf_op" not in second
    assert hlo_instructions(str(tmp_path / "none")) == {}
