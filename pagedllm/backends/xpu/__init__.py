"""The xpu backend."""
