"""Weight sync from the policy to the inference engines."""
