"""The train rank: command loop and handlers (started by ``accelerate launch -m rlsdk.worker``)."""
