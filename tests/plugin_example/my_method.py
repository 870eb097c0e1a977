"""The README's "Add a method" example as a file in a user's folder (tests/test_readme.py checks that the
README holds this text)."""

from pydantic import Field

from fedskew.algorithms.base import ALGORITHMS, Algorithm, HyperParams, ServerUpdate


@ALGORITHMS.register("fedavg_slr")  # the name configs use: algorithm: {name: fedavg_slr}
class FedAvgServerLR(Algorithm):
    """FedAvg with a server learning rate: w <- w + lr (mean - w) (Reddi et al. 2021, Alg. 2 with SGD)."""

    class Params(HyperParams):  # typed hyper-parameters; an unknown key is refused
        server_lr: float = Field(1.0, gt=0, description="server learning rate (1: FedAvg)")

    def server_step(self, server, mean, info):  # mean: the uploads' weighted mean (or a robust rule's)
        w, avg, lr = server["weights"], mean.model_state(), self.p.server_lr
        new = {k: w[k] + lr * (avg[k] - w[k]) if w[k].is_floating_point() else avg[k] for k in w}
        return ServerUpdate({**server, "weights": new})
