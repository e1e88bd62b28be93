"""ONNX export of CA-DeiT through the matmul DFT backend matches torch in onnxruntime."""
from __future__ import annotations

import onnx


def test_export_ca_deit_tiny(run_tool, tmp_path):
    path = tmp_path / "ca_deit_tiny.onnx"
    text = run_tool("export_onnx", "--out", str(path), "--img-size", "64")
    model = onnx.load(str(path))
    onnx.checker.check_model(model)
    ops = {node.op_type for node in model.graph.node}
    assert "MatMul" in ops and not any("FFT" in op or "DFT" in op for op in ops)
    error = float(text.split("max relative difference ")[1].split()[0])
    assert error < 1e-4
