"""Op families. Each module has a plain PyTorch reference (`*_ref`) and a public function that
the model calls; on CUDA the public function may route to a Triton kernel with the same contract."""
