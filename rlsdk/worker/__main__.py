"""Entry point of a train rank: ``accelerate launch ... -m rlsdk.worker``."""

from rlsdk.worker.main import main

if __name__ == "__main__":
    main()
