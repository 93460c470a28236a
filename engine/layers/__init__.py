"""The building blocks of the native models: linear layers that load and shard their own weights through a
pluggable linear method, the vocabulary-parallel embedding and LM head, RMSNorm and the rotary tables."""
