"""Built-in models, written as a user writes their own: plain callables named by `_target_` in
conf/model/<name>.yaml, taking what the data decides (num_classes, input_shape, vocab_size, ...)
through parameters of those names. The engine never imports this package by name."""
