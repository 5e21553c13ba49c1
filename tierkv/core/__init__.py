"""What both sides of the socket share: layout, keys, errors, units, wire protocol, paths."""
