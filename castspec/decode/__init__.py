"""The decoding core: the draft tree as data, the target model with its KV cache, verification (greedy and
sampling), growing trees with a drafter under a policy, and the stepping engine (add / step / abort).
Imports policies, drafters and costs' tables; never the shells (bench, serve, cli) or the api."""
