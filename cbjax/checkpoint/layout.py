"""What a converted checkpoint directory holds, named without importing JAX (the front end resolves
model arguments to directories; only loading them needs JAX).

    params/       orbax checkpoint: nested dict of parameters named by nnx path, in the model's layout
    config.json   the HF config, with "dtype" set to the dtype the params were written in
    kv_scales.json  each layer's fp8 KV-cache scales, where the HF checkpoint had them (kv_scale_tensors.py)
"""

PARAMS_DIR = "params"
KV_SCALES_FILE = "kv_scales.json"
