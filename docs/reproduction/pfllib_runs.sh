#!/usr/bin/env bash
# The fedskew side of docs/reproduction/pfllib.md: the methods fedskew shares with PFLlib's Fashion-MNIST
# benchmark table, under PFLlib's protocol (configs/pfllib/), on a reduced round budget.
#   FEDSKEW_DATA=../shared/data bash docs/reproduction/pfllib_runs.sh runs/pfllib
#   python docs/reproduction/pfllib_tables.py runs/pfllib
# ROUNDS (default 20; PFLlib: 2000), SEEDS (default 0-2: PFLlib's three trials), JOBS and METHODS override.
# Measured here: fedavg, one round of fmnist-pat at engine.threads 1 = 66.7 s wall (61.9 s training,
# 4.1 s evaluation) on the shared 2-core machine; methods with extra local passes (ditto, pfedme, apfl,
# perfedavg, fedala, fedbabu's fine-tuning) cost more per round.
set -euo pipefail
OUT=${1:-runs/pfllib}
ROUNDS=${ROUNDS:-20}
SEEDS=${SEEDS:-0-2}
JOBS=${JOBS:-2}
METHODS=${METHODS:-"fedavg fedprox fedgen perfedavg pfedme ditto apfl fedfomo fedala fedper fedrep fedrod fedbabu fedproto"}
for part in pat dir0.1; do
  for method in $METHODS; do
    fedskew sweep "configs/pfllib/fmnist-$part.yaml" --seeds "$SEEDS" --jobs "$JOBS" --out "$OUT" \
      --name "$part-$method" --set "algorithm.name=$method" --set "rounds=$ROUNDS" --set engine.threads=1
  done
done
