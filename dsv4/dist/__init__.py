"""dsv4.dist"""
