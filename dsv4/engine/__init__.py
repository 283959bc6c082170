"""dsv4.engine"""
