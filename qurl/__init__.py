"""qurl: RL from verifiable rewards with 8-bit quantized rollout (QuRL: ACR + UAQ)."""
