export PYTHONPATH=/tmp/dcpasync-tree/packages/sidestream/src:/tmp/dcpasync-tree/integrations/sidestream-wandb/src:/tmp/dcpasync-tree/integrations/sidestream-mlflow/src:/tmp/dcpasync-tree/integrations/sidestream-tensorboard/src:/tmp/dcpasync-tree/integrations/sidestream-torchmetrics/src
PY="nice -n 10 timeout 300 /work/main/.venv/bin/python"
