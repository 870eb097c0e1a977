#!/usr/bin/env bash
# The runs of docs/reproduction/system.md: FedAvg on MNIST (long tail, Dirichlet(0.1), slow clients holding
# the rare classes) under five server policies on the virtual clock, seeds 0-4. Round counts differ so that
# every policy passes the T = 300 s virtual-time budget the page compares at.
#   FEDSKEW_DATA=../shared/data bash docs/reproduction/system_runs.sh runs/system
#   python docs/reproduction/system_tables.py runs/system
set -euo pipefail
OUT=${1:-runs/system}
C=configs/system/mnist-longtail-slow.yaml
sweep() { name=$1; shift; fedskew sweep "$C" --seeds 0-4 --jobs 2 --out "$OUT" --name "$name" "$@"; }
sweep full-wait --set rounds=30
sweep deadline --set rounds=40 --set clock.deadline=10
sweep over-selection --set rounds=110 --set clock.over_selection=1.3
sweep fedbuff --set rounds=220 --set eval.every=2 --set clock.aggregation=fedbuff --set clock.buffer=5 \
  --set clock.concurrency=10
sweep fedasync --set rounds=1100 --set eval.every=10 --set clock.aggregation=fedasync --set clock.concurrency=10
