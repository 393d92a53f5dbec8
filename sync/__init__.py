"""Weight sync from the policy to the inference engines: the bracket, the transfer, the transports."""

__all__: list[str] = []
