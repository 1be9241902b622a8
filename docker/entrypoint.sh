#!/bin/sh
# With no arguments: what this machine can do, then the training benchmark on
# its GPU. With arguments: run them (e.g. `tierstore config`, `python train.py`).
set -e
if [ "$#" -eq 0 ]; then
    tierstore bench storage --dir /spill
    exec tierstore bench train --device cuda --dir /spill
fi
exec "$@"
