"""Weight sync from the policy to the inference engines: the bracket and the transports."""

__all__: list[str] = []
