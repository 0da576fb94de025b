"""What a forward costs on this machine: the cost table f(B, c, n) and its lookups (table), measuring it
(profile), learning it while decoding (online), and where an engine's costs start (probe)."""
