"""What a converted checkpoint directory holds, named without importing JAX (the front end resolves
model arguments to directories; only loading them needs JAX).

    params/       orbax checkpoint: nested dict of parameters named by nnx path, in the model's layout
    config.json   the HF config, with "dtype" set to the dtype the params were written in
"""

PARAMS_DIR = "params"
