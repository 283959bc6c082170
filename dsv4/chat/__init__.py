"""dsv4.chat"""
