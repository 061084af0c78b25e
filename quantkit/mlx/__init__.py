"""MLX's affine quantized format (mlx-lm model directories): packing, calibrated scales, reading back."""
