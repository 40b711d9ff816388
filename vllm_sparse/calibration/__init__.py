"""Kascade calibration (``vllm-sparse calibrate``): anchor layers and head maps from a dense run.

``similarity``: the layer-to-layer recovery matrix and head similarities from pooled attention;
``anchors``: the paper's dynamic program over that matrix; ``run``: the dense model on a
calibration set, the YAML config and the PNG.
"""
