export PYTHONPATH=/tmp/operate-tree/packages/sidestream/src:/tmp/operate-tree/integrations/sidestream-wandb/src:/tmp/operate-tree/integrations/sidestream-mlflow/src:/tmp/operate-tree/integrations/sidestream-tensorboard/src:/tmp/operate-tree/integrations/sidestream-torchmetrics/src
PY=/work/main/.venv/bin/python
