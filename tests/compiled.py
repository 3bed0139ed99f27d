"""How many graphs torch.compile has compiled in this process (each new shape of a part is one more)."""


def compilations() -> int:
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])
