"""Training of the project's own default image model (``shapes:64``): the data is :mod:`mlx_engine.imagegen.shapes_data`,
the scripts are :mod:`training.train_image` (autoencoder, then diffusion transformer, on MLX) and the prompt-following
evaluation is :mod:`training.evaluate`.

This package drives ``mx.value_and_grad``, so it imports ``mlx`` (the layer rule restricts ``models/``, ``kvcache/``,
``imagegen/`` and ``cli/`` only). The forward passes are the project's inference classes
(:class:`mlx_engine.imagegen.vae.AutoencoderKL`, :class:`mlx_engine.imagegen.transformer.ZImageTransformer`) run on ``MLXTensor``\\ s whose
arrays are the trained parameters, so training and inference share one implementation.
"""
