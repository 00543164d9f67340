"""The label that takes no part in a loss: what samples write after an end-of-document token or over
padding, and what every loss skips. Its own module, without torch, so the data code can import it freely."""

IGNORE = -100
