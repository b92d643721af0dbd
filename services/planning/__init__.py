"""Capacity planning (`kvmesh plan`): the engines a target load needs, from a
measured engine profile, by queueing arithmetic instead of trial."""
