# Sourced after _stages.sh by scripts that run TorchTitan on the GPU machine.
# TorchTitan from the carried wheels; its trainer imports Hugging Face `datasets`, absent on the GPU machine and
# never read here (Regent's synthetic data): a placeholder package stands in, as in titan_speed.py.
if compgen -G ".whl/titan/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/titan/*.whl
  if ! $PY -c "import datasets" 2>/dev/null; then
    mkdir -p /tmp/site/datasets
    cat > /tmp/site/datasets/__init__.py <<'PY'
def _unavailable(*args, **kwargs):
    raise RuntimeError("Hugging Face datasets is a placeholder here (heal_one_gpu.sh uses synthetic data)")
class Dataset: pass
class IterableDataset: pass
load_dataset = concatenate_datasets = _unavailable
PY
    echo "split_dataset_by_node = None" > /tmp/site/datasets/distributed.py
  fi
  export PYTHONPATH=src:/tmp/site
fi
