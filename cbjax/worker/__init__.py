"""The device side: the model runner, its input batch, compilation, sampling and distribution."""
