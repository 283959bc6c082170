"""dsv4.server"""
