"""What code reads of an object: the protocol checks wrap trunks and drafters in a Recorder and
compare what it saw with the protocol's members."""


def members(proto: type) -> set[str]:
    names = set(getattr(proto, "__annotations__", {}))
    return names | {n for n, v in vars(proto).items() if callable(v) and not n.startswith("_")}


class Recorder:
    """Forwards every attribute to `inner` and notes its name."""

    def __init__(self, inner):
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "seen", set())

    def __getattr__(self, name):
        self.seen.add(name)
        return getattr(self._inner, name)

    def __setattr__(self, name, value):
        self.seen.add(name)
        setattr(self._inner, name, value)
