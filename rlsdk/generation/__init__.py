"""Generation shared by every engine that samples in-process: the embedded engine (in the controller) and the
colocated engine (on the train ranks, through ``TrainEngine.generate``).

It lives outside ``rlsdk.engine`` so that the train and inference engines share it without importing each other:
:mod:`~rlsdk.generation.params` (``SamplingParams``), :mod:`~rlsdk.generation.stopping` (special tokens and stop
strings, one rule for every engine), :mod:`~rlsdk.generation.sampling` (the KV-cache decode loop) and
:mod:`~rlsdk.generation.kv_cache` (the key/value cache it preallocates for a whole generation).
"""
