"""Chapter 6: bidirectional SSMs as quasiseparable matrices."""
