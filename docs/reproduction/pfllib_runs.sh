#!/usr/bin/env bash
# The fedskew side of docs/reproduction/pfllib.md: the methods fedskew shares with PFLlib's Fashion-MNIST
# benchmark table, under PFLlib's protocol (configs/pfllib/), on a reduced round budget.
#   FEDSKEW_DATA=../shared/data bash docs/reproduction/pfllib_runs.sh runs/pfllib
#   python docs/reproduction/pfllib_tables.py runs/pfllib
# ROUNDS (default 5; PFLlib: 2000), SEEDS (default 0; PFLlib's three trials would be 0-2), PARTS (default
# "pat dir0.1"), JOBS and METHODS override. The page's numbers: ROUNDS=5 SEEDS=0, one partition per core:
#   PARTS=pat bash docs/reproduction/pfllib_runs.sh runs/pfllib &
#   PARTS=dir0.1 bash docs/reproduction/pfllib_runs.sh runs/pfllib; wait
# Measured (2-core machine, one run per core): FedAvg about 35 s a round; pfllib_tables.py prints every
# method's seconds per round.
set -euo pipefail
OUT=${1:-runs/pfllib}
ROUNDS=${ROUNDS:-5}
SEEDS=${SEEDS:-0}
JOBS=${JOBS:-1}
PARTS=${PARTS:-"pat dir0.1"}
METHODS=${METHODS:-"fedavg fedper fedrep fedrod fedproto ditto apfl fedfomo fedbabu fedala fedprox fedgen perfedavg pfedme"}
for part in $PARTS; do
  for method in $METHODS; do
    fedskew sweep "configs/pfllib/fmnist-$part.yaml" --seeds "$SEEDS" --jobs "$JOBS" --threads 1 --out "$OUT" \
      --name "$part-$method" --set "algorithm.name=$method" --set "rounds=$ROUNDS"
  done
done
