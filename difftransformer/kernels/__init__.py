"""The optional kernels that live outside the flat remote-code model files.

Nothing in the model files imports this package relatively, so ``save_pretrained`` never copies it into a saved folder
(transformers copies every module a modeling file imports relatively). The model files load it by its absolute name,
only where a kernel here is chosen or used (``kernels_difftransformer.triton_kernels``), and run without it where it
cannot be imported: triton is not installed, or a remote-code folder runs where the difftransformer package is absent.
"""
