# Set up tierstore on a bare CUDA machine that cannot reach a package index.
#
#   source benchmarks/device-setup.sh
#
# Expects the machine's python3 to hold torch (CUDA build) and the missing
# dependencies as wheels in .whl/ (see benchmarks/README.md, "On a GPU").
# Installs them and tierstore itself (editable, so tests run from the tree).
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e .
python3 -c "import torch, tierstore; print('torch', torch.__version__, '| cuda', torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else '')"
set +e
