"""Theory next to measurement: closed forms of speculative decoding's expected gains."""
